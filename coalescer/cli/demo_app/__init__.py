"""What `coalescer demo` runs when not given ``--rules``: its rules file (``rules.yaml``,
shipped with the package) and the handlers it names (``handlers``), so the demo needs
no checkout of the repository.

Part of the command line layer: may import anything of coalescer below it.
"""

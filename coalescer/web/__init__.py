"""The HTTP API of a node, its status page and the page's static file.

May import everything below it (the ``Coalescer`` façade included); never the CLI.
"""

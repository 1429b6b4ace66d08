"""``python manage.py coalescer ...``: the ``coalescer`` command run inside Django.

Unlike the rest of ``coalescer.integrations``, this package is a command-line entry
point (Django finds its commands in an app's ``management/commands``): it may import
``coalescer.cli``.
"""

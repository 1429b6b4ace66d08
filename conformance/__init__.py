"""The conformance suite of the touch protocol: JSON vectors in levels, a runner that
starts real servers and drives any client through a line-JSON adapter, and the
Python client's adapter (see conformance/README.md)."""

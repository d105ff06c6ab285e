"""Miles on a Ray cluster: the ``ray`` executor (see README.md)."""

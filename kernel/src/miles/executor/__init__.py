"""Process supervision for the ``local`` executor."""

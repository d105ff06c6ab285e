"""miles-megatron: the ``megatron`` train backend (megatron-core with TP, PP, CP and EP).

Importing this package is cheap; megatron-core loads when a backend is built.
"""

__all__: list[str] = []

"""miles-fsdp: the ``fsdp`` train backend (FSDP2 over Hugging Face causal LMs).

Pick it with ``train.backend: fsdp``; its own options are the ``fsdp`` config section
(:class:`miles_fsdp.config.FSDPSection`). The backend class is
:class:`miles_fsdp.backend.FSDPBackend`; ``miles bench train`` measures it. Nothing heavy is
imported here: torch and transformers load with the backend. Design notes: ``docs/design/fsdp.md``.
"""

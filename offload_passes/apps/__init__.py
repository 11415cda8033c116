"""The applications built on the backend: ``offload-demo`` (:mod:`.demo`, the command line) and its forms,
the recipe model's decode run (:mod:`.demo`), the Hugging Face model (:mod:`.hf`), the multi-rank layout
(:mod:`.world`) and the serving loop (:mod:`.serve`), over what they share (:mod:`.common`).

They use the package as a user does (``make_offload_backend``, ``models``, the state); the core package
never imports them (``tests/test_import_structure.py``).
"""

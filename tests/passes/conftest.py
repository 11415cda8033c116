"""The passes' tests (detection, rewrite, reinplace, refusals, scaling): the synthetic DSA model (``tests/dsa_synth.py``) and helpers (``tests/backend_helpers.py``)
are importable by name; the compile settings are ``tests/compile_settings.py``'s."""
from compile_settings import _backend_process_settings, _fresh_dynamo  # noqa: F401  (autouse fixtures)

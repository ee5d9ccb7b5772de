"""Reference models: analytic profiles (pure Python) and, in torch modules, layer lists; and the user's own.

``hetrain.models.user.resolve_model`` gives any model ``--model`` names (a reference
model, ``hf:DIR`` a local Hugging Face causal LM (``hetrain.models.hf``), or
``MODULE:FUNCTION`` returning the user's, parsed by ``hetrain.models.spec``).

This package's ``__init__`` imports no torch: ``hetrain.models.analytic`` is part
of the planning side.
"""

"""Training learned components: IntentKV's residual head (``agentkv train-intentkv``; its
``alpha_max`` recalibrated with ``agentkv calibrate-intentkv``) and
KVzap surrogates on KVzip+ targets (``agentkv train-kvzap``). Sits above the engine layer (it
loads models and reads trace sources)."""

"""Training learned components (``agentkv train-intentkv``: IntentKV's residual head). Sits
above the engine layer (it loads models and reads trace sources)."""

"""Training KVzap surrogates: KVzip+ targets from the model, the corpus, the fit (``agentkv
train-kvzap``). Sits above the engine layer (it loads models and reads trace sources)."""

"""agentkv.methods."""

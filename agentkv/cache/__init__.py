"""agentkv.cache."""

"""Pre-training. `quickstart` is the built-in `k3 train` job (tiny model, built-in corpus, CPU)."""

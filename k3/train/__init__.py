"""Pre-training (K3_SPEC §7): Per-Head Muon + QK-clip (`optim`, `qkclip`), Quantile Balancing (`balance`),
the trainer behind `k3 train` (`trainer`, `config`, `state`, `metrics`)."""

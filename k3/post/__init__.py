"""Post-training: SFT / RL / MOPD / draft training. The chat format they train on is `k3.io.chat`."""

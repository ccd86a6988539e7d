"""`specgate eagle train`: an EAGLE head for the served model, trained on this machine."""

"""SVI training scripts, one per task, with the paper's hyperparameters as presets."""

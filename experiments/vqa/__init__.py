"""Visual question answering on easy-VQA with MCAN, and its uncertainty: ``python -m experiments.vqa``."""

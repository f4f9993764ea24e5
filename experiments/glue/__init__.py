"""GLUE finetuning of a pretrained BERT-style model with Bayesian attention: ``python -m experiments.glue``."""

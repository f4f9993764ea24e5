"""Node classification with graph attention on Planetoid (Cora, Citeseer, Pubmed), and its uncertainty: ``python -m experiments.gat``."""

"""Translation on Multi30k (de -> en), its decoding search and its attention's uncertainty: ``python -m experiments.nmt``."""

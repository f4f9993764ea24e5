"""Image captioning with Att2in on Flickr8k or a Karpathy split, its scores and attention: ``python -m experiments.captioning``."""

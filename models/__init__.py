"""Task models built on bam_pyro."""

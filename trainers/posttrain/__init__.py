"""The post-training trainer that runs on the ranks (TRL), its recipe section and its launch."""

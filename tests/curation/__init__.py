"""Tests of the data library (curation/), one file per module."""

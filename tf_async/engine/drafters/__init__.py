"""The drafters (ngram, a draft model, the MTP layer) and their registry of kinds."""

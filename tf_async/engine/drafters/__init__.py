"""Ring drafters: a smaller draft model (`draft:PATH`) and the MTP layer (`mtp`)."""

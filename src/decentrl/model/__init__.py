"""Model loading, stage plans and stage modules."""

"""MaxText's decoder as the policy: the adapter (imports maxtext lazily) and the pure weight mapping."""

"""Bundles for air-gapped clusters: made where the internet is, checked and imported
where it is not (docs/offline.md)."""

"""Data only: strict operator/plan models, msgspec records, catalog and corpus loaders."""

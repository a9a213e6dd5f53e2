"""KV levels' storage: one protocol (StorageLevel), one file per medium, a registry of media by name."""

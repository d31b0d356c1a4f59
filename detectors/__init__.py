"""detectors: see DESIGN.md."""

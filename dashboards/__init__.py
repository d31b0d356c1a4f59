"""dashboards: see DESIGN.md."""

"""tracer: see DESIGN.md."""

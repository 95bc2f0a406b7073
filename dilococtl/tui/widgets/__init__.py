"""The dashboard's widgets, one module per area."""

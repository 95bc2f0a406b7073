"""Screens pushed over the dashboard: help, a site's log."""

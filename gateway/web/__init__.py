"""The web pages: the playground and the operator console (pages.py; assets in static/)."""

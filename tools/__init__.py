"""Maintenance scripts: documentation generators and checks."""

"""Tophat services: each subpackage is one asyncio process (`python -m services.<name>`)."""

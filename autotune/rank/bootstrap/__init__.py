"""Put first on the ranks' PYTHONPATH: Python imports its sitecustomize.py at start-up.

(This file only makes the folder a package, so the wheel ships it.)
"""

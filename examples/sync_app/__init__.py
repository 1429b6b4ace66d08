"""The synchronous example: a Flask app under gunicorn (--preload) touching keys."""

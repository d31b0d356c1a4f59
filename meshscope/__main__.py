from meshscope.cli import app

app()

"""The root-cause view: a Streamlit app over run stores (`meshscope view`).

`data.py` computes (pure functions, tested without Streamlit); `app.py` and `pages/` show.
"""

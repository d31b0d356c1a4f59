"""The root-cause view: a Streamlit app over run stores (`meshscope view`).

`data.py` computes (pure functions, tested without Streamlit); `app.py` and `screens/` show
(not `pages/`: Streamlit would list that folder by file name on a deep link's first load).
"""

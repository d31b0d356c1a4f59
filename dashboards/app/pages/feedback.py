import streamlit as st
st.title("Feedback")

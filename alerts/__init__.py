"""Alerts: one routing model (`config`), the messages (`notify.Alert`), the channels (Slack,
email) and the outbox that retries them. The embedded path and Alertmanager read the same
routing. Imports only `meshscope.collector` of ours."""

"""Evidence: capture before acting, classify the wedge, write incident reports."""

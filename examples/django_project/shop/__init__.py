"""The example's app: orders, and each customer's stats that coalescer refreshes."""

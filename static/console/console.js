// The console's only script: copy a value (an idempotency key, a remote reference) to the
// clipboard from a button carrying it in data-copy. Everything else works without JavaScript.
document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button || !navigator.clipboard) return;
  navigator.clipboard.writeText(button.dataset.copy).then(() => {
    button.textContent = "copied";
    setTimeout(() => { button.textContent = "copy"; }, 1500);
  });
});

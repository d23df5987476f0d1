//! Panics that are someone else's bug, reported as errors: the message of a caught panic, and
//! [`catch_quietly`] for library calls that assert where they should return an error (redb on
//! a truncated file, cudarc without a driver), so the user sees one clear error instead of a
//! `thread 'main' panicked at ~/.cargo/registry/...` line above it.

use std::cell::Cell;
use std::panic::UnwindSafe;
use std::sync::Once;

/// The message of a panic payload (`panic!` with a string or a format), for error reports.
pub fn message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

thread_local! {
    /// Set while this thread runs inside [`catch_quietly`].
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

static HOOK: Once = Once::new();

/// Runs `f`; a panic inside it becomes `Err(its message)` and is not printed. Panics on other
/// threads, and on this one outside `f`, are reported by the previous hook as before (the
/// wrapper hook is installed once, process-wide, and only looks at a thread-local flag).
pub fn catch_quietly<T>(f: impl FnOnce() -> T + UnwindSafe) -> Result<T, String> {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was_quiet = QUIET.with(|q| q.replace(true));
    let result = std::panic::catch_unwind(f);
    QUIET.with(|q| q.set(was_quiet));
    result.map_err(|payload| message(payload.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message_and_the_flag_is_restored() {
        assert_eq!(catch_quietly(|| 3), Ok(3));
        let n = 7;
        assert_eq!(
            catch_quietly(|| -> u8 { panic!("bad length {n}") }),
            Err("bad length 7".to_string())
        );
        assert_eq!(
            catch_quietly(|| std::panic::panic_any(5u8)),
            Err("non-string panic payload".to_string())
        );
        assert!(!QUIET.with(Cell::get));
    }
}

//! The `tine` command line: everything it does is in the library
//! (`tine::cli`).

fn main() -> std::process::ExitCode {
    tine::cli::main()
}

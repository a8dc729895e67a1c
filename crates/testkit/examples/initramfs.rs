//! Writes the test initramfs into the directory given as the argument.
fn main() {
    let dir = std::env::args().nth(1).expect("usage: initramfs DIR");
    let path = testkit::build_test_initramfs(std::path::Path::new(&dir));
    println!("{}", path.display());
}

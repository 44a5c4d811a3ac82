//! The loss curves of a run (pretraining's, or any loop's [`StepMetrics`]) as a PNG: training loss per step and validation loss at each
//! evaluation, drawn with plotters into an RGB buffer (text in the embedded DejaVu Sans, so no
//! system font is needed) and written atomically with the `png` encoder.

use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;
use wildfire_engine::metrics::StepMetrics;

const WIDTH: u32 = 800;
const HEIGHT: u32 = 480;

fn register_font() {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .unwrap_or_else(|_| panic!("the embedded DejaVu Sans is a valid font"));
    });
}

/// Draw the training and validation loss of `steps` into a PNG at `path`, its folder made if
/// missing (nothing for no step).
pub fn plot_losses(path: &Path, steps: &[StepMetrics]) -> std::io::Result<()> {
    let (Some(first), Some(last)) = (steps.first(), steps.last()) else {
        return Ok(());
    };
    register_font();
    let plot_err = |e: String| std::io::Error::other(format!("drawing the loss plot: {e}"));
    let losses = steps
        .iter()
        .map(|s| s.loss)
        .chain(steps.iter().filter_map(|s| s.val_loss))
        .filter(|l| l.is_finite());
    let (lo, hi) = losses.fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    let (lo, hi) = if hi > lo {
        let pad = 0.05 * (hi - lo);
        (lo - pad, hi + pad)
    } else if lo.is_finite() {
        (lo - 1.0, lo + 1.0)
    } else {
        (0.0, 1.0)
    };
    let (s0, s1) = (first.step, last.step.max(first.step + 1));
    let mut rgb = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
        let draw = || -> Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(&root)
                .caption("loss", ("sans-serif", 22))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d(s0..s1, lo..hi)?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc("loss")
                .label_style(("sans-serif", 14))
                .draw()?;
            let blue = RGBColor(31, 119, 180);
            chart
                .draw_series(LineSeries::new(
                    steps.iter().map(|s| (s.step, s.loss)),
                    blue.stroke_width(2),
                ))?
                .label("train")
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], blue.stroke_width(2))
                });
            let val: Vec<(usize, f32)> = steps
                .iter()
                .filter_map(|s| s.val_loss.map(|v| (s.step, v)))
                .collect();
            if !val.is_empty() {
                let red = RGBColor(214, 39, 40);
                chart
                    .draw_series(LineSeries::new(val.iter().copied(), red.stroke_width(2)))?
                    .label("val")
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 20, y)], red.stroke_width(2))
                    });
                chart.draw_series(val.iter().map(|&p| Circle::new(p, 3, red.filled())))?;
            }
            chart
                .configure_series_labels()
                .label_font(("sans-serif", 14))
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| plot_err(e.to_string()))?;
    }
    let mut png_bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut png_bytes, WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut w| w.write_image_data(&rgb))
        .map_err(|e| plot_err(e.to_string()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    wildfire_checkpoint::io::write_atomic(path, &png_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plot is a PNG of the stated size with the curves' colours in it.
    #[test]
    fn writes_a_png_with_both_curves() {
        let path = std::env::temp_dir().join(format!("wildfire-plot-{}.png", std::process::id()));
        let steps: Vec<StepMetrics> = (0..20)
            .map(|step| StepMetrics {
                step,
                loss: 4.0 - step as f32 * 0.1,
                val_loss: (step % 5 == 4).then_some(4.1 - step as f32 * 0.1),
                ..Default::default()
            })
            .collect();
        plot_losses(&path, &steps).unwrap();
        let decoder =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (WIDTH, HEIGHT));
        let has = |c: [u8; 3]| buf.chunks(3).any(|p| p == c);
        assert!(has([31, 119, 180]), "no training curve");
        assert!(has([214, 39, 40]), "no validation curve");
        std::fs::remove_file(&path).unwrap();
        plot_losses(&path, &[]).unwrap();
        assert!(!path.exists());
    }
}
